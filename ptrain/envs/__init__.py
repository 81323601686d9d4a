from ptrain.envs.arithmetic import check_answer as check_answer
from ptrain.envs.arithmetic import extract_answer as extract_answer
