"""m2live: mechanistic, clock-aware prediction of LLM serving engine step times.

Importable with numpy alone: no vLLM, torch or GPU needed.
"""

from .hardware import GpuSpec, UnknownGpuError, all_gpus, get_gpu
from .predictor import HostConstants, OpModel, Prediction, Predictor
from .shapes import ModelShape, ModelShapeError, get_model
from .step import Step, StepError

__all__ = [
    "GpuSpec", "UnknownGpuError", "all_gpus", "get_gpu",
    "HostConstants", "OpModel", "Prediction", "Predictor",
    "ModelShape", "ModelShapeError", "get_model",
    "Step", "StepError",
]
__version__ = "0.1.0"
