"""A reference DeepSeek-V4-shaped model that reads and writes the flatkv_jax cache.

It exists to prove the cache right: the cached step must give the same logits as the dense,
cache-free recomputation. See docs/model.md.

- the model: :class:`DeepSeekV4`, a ``flax.nnx`` module with ``step`` / ``propose`` /
  ``dense`` (the interface a serving engine drives; layers in :mod:`flatkv_jax.model.modules`)
- config: :class:`ModelConfig`, :func:`tiny_model`, :func:`v4_flash_model`
- parameters: :class:`Params`, :func:`init_params`, :func:`random_params`, :func:`param_shapes`
- row codecs: :mod:`flatkv_jax.model.quant`
- dense reference: :func:`dense_forward`
- the same as functions of a ``Params`` pytree: :class:`StepBatch`, :class:`StepOutput`, :func:`step`,
  :func:`make_step`; MTP drafts: :class:`DraftBatch`, :class:`DraftOutput`, :func:`propose`,
  :func:`make_propose`
"""

from flatkv_jax.model import quant
from flatkv_jax.model.cached import (
    DraftBatch,
    DraftOutput,
    StepBatch,
    StepOutput,
    check_model_plan,
    check_plan,
    make_propose,
    make_step,
    propose,
    step,
)
from flatkv_jax.model.config import ModelConfig, tiny_model, v4_flash_model
from flatkv_jax.model.dense import dense_forward
from flatkv_jax.model.modules import DeepSeekV4
from flatkv_jax.model.params import Params, init_params, param_shapes, random_params

__all__ = [
    "DeepSeekV4",
    "DraftBatch",
    "DraftOutput",
    "ModelConfig",
    "Params",
    "StepBatch",
    "StepOutput",
    "check_model_plan",
    "check_plan",
    "dense_forward",
    "init_params",
    "make_propose",
    "make_step",
    "param_shapes",
    "propose",
    "quant",
    "random_params",
    "step",
    "tiny_model",
    "v4_flash_model",
]
