"""Built-in quantization methods (docs/quantization.md): ``fp8`` and ``int4`` quantize an unquantized
checkpoint on load; ``fp8``, ``awq``, ``gptq``, ``mxfp4`` and ``compressed-tensors`` load pre-quantized ones."""
import kvforge


@kvforge.hookimpl
def register_quantization_methods(register):
    register("fp8", "kvforge.plugins.quantization.fp8:Fp8Quantization")
    register("int4", "kvforge.plugins.quantization.int4:Int4Quantization")
    register("awq", "kvforge.plugins.quantization.awq:AwqQuantization")
    register("gptq", "kvforge.plugins.quantization.gptq:GptqQuantization")
    register("mxfp4", "kvforge.plugins.quantization.mxfp4:Mxfp4Quantization")
    register("compressed-tensors", "kvforge.plugins.quantization.compressed_tensors:CompressedTensorsQuantization")
