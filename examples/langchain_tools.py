"""LangChain against `kvforge serve`: forced tool calls with ``bind_tools`` and a pydantic object with
``with_structured_output(method="function_calling")``.

    pip install langchain-openai
    kvforge serve &                      # the default model, on 127.0.0.1:8000
    python examples/langchain_tools.py   # --base-url, --model to point it elsewhere

Both requests force the tool (``tool_choice`` a named function), which kvforge enforces with structured
outputs, so even the small default model returns calls that parse. Without a forced choice LangChain sends
``tool_choice="auto"`` (OpenAI's default with tools), which needs the server to run with
``--enable-auto-tool-choice --tool-call-parser NAME`` (docs/tools.md).
"""
from __future__ import annotations

import argparse

from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(description="the city")
    celsius: int = Field(description="the temperature in degrees Celsius")


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"22 C and sunny in {city}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = p.parse_args()
    llm = ChatOpenAI(base_url=args.base_url, api_key="unused", model=args.model, temperature=0, max_tokens=64)

    with_tools = llm.bind_tools([get_weather], tool_choice="get_weather")
    reply = with_tools.invoke("What is the weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather", reply
    print("bind_tools:", reply.tool_calls)

    structured = llm.with_structured_output(Weather, method="function_calling")
    weather = structured.invoke("It is 18 degrees in Oslo. Report the weather.")
    assert isinstance(weather, Weather), weather
    print("with_structured_output:", weather)


if __name__ == "__main__":
    main()
