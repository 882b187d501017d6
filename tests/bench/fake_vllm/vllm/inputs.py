def TokensPrompt(prompt_token_ids):  # noqa: N802 (vLLM's name: a TypedDict)
    return {"prompt_token_ids": list(prompt_token_ids)}
