"""Built-in reasoning parsers (the contract: kvforge.tool_parsing.ReasoningParser)."""
from kvforge.hookspecs import hookimpl


@hookimpl
def register_reasoning_parsers(register):
    register("deepseek_r1", "kvforge.plugins.reasoning_parsers.think:DeepSeekR1ReasoningParser")
    register("qwen3", "kvforge.plugins.reasoning_parsers.think:Qwen3ReasoningParser")
