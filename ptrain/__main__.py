"""`python -m ptrain` and the `ptrain` console script: the Hydra entry point."""

from ptrain.cli import main

if __name__ == "__main__":
    main()
