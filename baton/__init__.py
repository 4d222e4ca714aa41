"""Baton: an LLM serving engine with disaggregated prefill and decode."""
from baton.engine.llm import LLM, RequestOutput
from baton.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
