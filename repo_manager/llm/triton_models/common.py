"""Shared by trm's Triton Python models (copied next to each model.py as trm_common.py)."""

import os


def parameter(config, key, default=None):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return default if value in (None, "") else value


def version_path(args, relative):
    """A path from config.pbtxt, relative to this version's folder unless absolute."""
    if os.path.isabs(relative):
        return relative
    return os.path.join(args["model_repository"], args["model_version"], relative)


def load_tokenizer(folder):
    """(tokenizers.Tokenizer, end_id, pad_id) from a Hugging Face tokenizer folder.

    Uses the ``tokenizers`` library on tokenizer.json rather than ``transformers``: it is what the fast
    tokenizers run anyway, it starts in milliseconds, and it needs nothing else in the serving image.
    """
    import json

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    settings = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path) as handle:
                settings.update(json.load(handle))

    def token_id(key):
        token = settings.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return tokenizer.token_to_id(token) if isinstance(token, str) else None

    end_id = token_id("eos_token")
    end_id = 0 if end_id is None else end_id
    pad_id = token_id("pad_token")
    return tokenizer, end_id, end_id if pad_id is None else pad_id
