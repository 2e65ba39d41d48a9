"""The torchtitan-shaped Llama now lives in ``fullshard.models.llama``; tests import it from here too."""
from fullshard.models.llama import *  # noqa: F401,F403
from fullshard.models.llama import Llama, LlamaArgs, build_plain, token_batch  # noqa: F401
