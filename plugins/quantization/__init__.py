"""Built-in quantization methods (docs/quantization.md): ``fp8``, weights quantized on load."""
import kvforge


@kvforge.hookimpl
def register_quantization_methods(register):
    register("fp8", "kvforge.plugins.quantization.fp8:Fp8Quantization")
