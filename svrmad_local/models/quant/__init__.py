"""The published quantized checkpoints (MXFP4 GPT-OSS, FP8 DeepSeek-V3), read by our own code:
formats.py (what a folder declares and holds), modules.py (packed modules), load.py (building a
model natively packed or dequantized). See docs/quantization.md."""
from .formats import MODES, SUPPORTED, QuantError, QuantSpec, check_dtypes, quant_spec, read_index
from .load import choose_mode, load_quantized
from .modules import (Fp8Experts, Fp8Linear, Mxfp4Experts, PackedModule, packed_modules,
                      set_kernel_impl)

__all__ = ["MODES", "SUPPORTED", "QuantError", "QuantSpec", "check_dtypes", "quant_spec", "read_index", "choose_mode",
           "load_quantized", "Fp8Experts", "Fp8Linear", "Mxfp4Experts", "PackedModule", "packed_modules", "set_kernel_impl"]
