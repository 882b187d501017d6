"""Built-in tool-call parsers, one module per output format (the contract: kvforge.tool_parsing)."""
from kvforge.hookspecs import hookimpl


@hookimpl
def register_tool_parsers(register):
    register("hermes", "kvforge.plugins.tool_parsers.hermes:HermesToolParser")
    register("llama3_json", "kvforge.plugins.tool_parsers.llama3_json:Llama3JsonToolParser")
    register("mistral", "kvforge.plugins.tool_parsers.mistral:MistralToolParser")
    register("pythonic", "kvforge.plugins.tool_parsers.pythonic:PythonicToolParser")
