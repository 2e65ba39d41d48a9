"""Plain GPT models (``nn.Module``s that never import the sharding engine).

Public API: :class:`GPT`, :class:`GPTConfig`, :class:`TransformerBlock`,
:class:`ArchSpec`, :data:`ARCHS`, :func:`arch_spec`, :func:`build_model`,
:func:`make_config`, :func:`make_param_init_fn`, :func:`num_params`.
"""

from .config import ARCHS, ArchSpec, GPTConfig, arch_spec, make_config
from .gpt import GPT, TransformerBlock, build_model, num_params
from .init import make_param_init_fn

__all__ = [
    "ARCHS",
    "ArchSpec",
    "GPT",
    "GPTConfig",
    "TransformerBlock",
    "arch_spec",
    "build_model",
    "make_config",
    "make_param_init_fn",
    "num_params",
]
