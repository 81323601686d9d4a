"""ptrain: post-training for language models in JAX.

Shape legend used in names throughout (`logits_BxLxV`, `mask_BxL`, ...):
  B  batch (sequences, or prompts for RL)      L  sequence length (tokens)
  V  vocabulary                                D  model width (d_model)
  H  query heads      K  key/value heads       Dh head dimension
  F  MLP hidden       E  routed experts        k  experts per token (top-k)
  G  group (samples per prompt in RL; expert groups in grouped matmul)
  M  rows of a grouped matmul (tokens * top_k) N  output columns

Batch contract of the train steps (all `[B, L]`, numpy or jax arrays):
  input_ids    int32  tokens fed to the model
  target_ids   int32  token to predict at each position (input_ids shifted left by one)
  loss_mask    float32 1.0 where the target counts toward the loss (assistant tokens)
  segment_ids  int32  packed-sequence id, 1.. per document; 0 marks padding
  positions    int32  position within its own segment (RoPE restarts per segment)
"""

__version__ = "0.1.0"
