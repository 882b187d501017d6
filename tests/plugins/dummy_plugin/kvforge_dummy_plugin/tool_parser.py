"""A toy tool-call format, built on the contract alone (kvforge.tool_parsing)::

    Sure. <call name="get_weather">{"city": "Paris"}</call>

A call whose tag or JSON is malformed is content; so is one left open at the end of the output.
"""
import re

from kvforge.tool_parsing import ToolParser

OPEN, CLOSE = '<call name="', "</call>"
HEAD = re.compile(r'<call name="([^"<>]*)">')


class DummyXmlToolParser(ToolParser):
    def _consume(self, text, final):
        items, pos = [], 0
        while True:
            start = text.find(OPEN, pos)
            close = text.find(CLOSE, start) if start >= 0 else -1
            if close < 0:  # no complete call ahead
                if final:
                    end = len(text)
                elif start >= 0:
                    end = start  # a call still open: wait for </call>
                else:
                    end = len(text) - self._held_back(text[pos:], OPEN)  # what may start a call waits
                items.append(text[pos:end])
                return items, end
            items.append(text[pos:start])
            head = HEAD.match(text, start)
            call = None
            if head is not None and head.end() <= close:
                call = self._call(head.group(1), self._decode(text[head.end():close]))
            items.append(call or text[start:close + len(CLOSE)])
            pos = close + len(CLOSE)
