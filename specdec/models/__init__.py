"""Native model implementations that read and write KV through block tables."""

from specdec.models.llama import LlamaForCausalLM, ModelArchConfig

__all__ = ["LlamaForCausalLM", "ModelArchConfig"]
