"""Write a model directory for serving benchmarks that send text: a preset's ``config.json`` with another
vocabulary size, and the tokenizer files of a model that has that vocabulary. Both ``kvforge serve DIR
--load-format dummy`` and ``vllm serve DIR --load-format dummy`` serve it with random weights, and
``vllm bench serve --tokenizer DIR`` makes its text prompts with it.

    python benchmarks/make_model_dir.py OUT_DIR [--preset llama-3-8b] [--tokenizer-from GGUF_OR_DIR]

Default: the Llama-3-8B shape with the default model's vocabulary (49,152) and tokenizer (SmolLM2).
"""
from __future__ import annotations

import argparse
import json
import os

from kvforge.model.config import ModelConfig
from kvforge.model.loader import default_model_path
from kvforge.tokenizer import load_tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--preset", default="llama-3-8b", help="the shape (a kvforge dummy preset)")
    p.add_argument("--tokenizer-from", default=None, help="GGUF file or HF directory (default: the default model)")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer_from or default_model_path())
    os.makedirs(args.out_dir, exist_ok=True)
    tokenizer.save_pretrained(args.out_dir)
    config = ModelConfig.from_preset(args.preset).to_hf_dict()
    config |= {"vocab_size": len(tokenizer), "torch_dtype": args.dtype,
               "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"{args.out_dir}: {args.preset} shape, vocabulary {config['vocab_size']}, tokenizer "
          f"{type(tokenizer).__name__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
