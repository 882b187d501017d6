import enum


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False, detokenize=True,
                 output_kind=RequestOutputKind.CUMULATIVE):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos
        self.detokenize, self.output_kind = detokenize, output_kind

    def record(self):
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "ignore_eos": self.ignore_eos,
                "detokenize": self.detokenize, "output_kind": self.output_kind.name}
