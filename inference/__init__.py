"""Inference backends behind one interface, plus chat templates and model preparation."""

from inference.backend import Backend, BackendError
from inference.types import GenerateRequest, GenerateResult, SamplingParams

__all__ = ["Backend", "BackendError", "GenerateRequest", "GenerateResult", "SamplingParams"]
