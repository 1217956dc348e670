"""A model's config.json as a plain object, so serving does not import transformers' config classes.

`AutoConfig.from_pretrained` imports the architecture's configuration module, and through it transformers'
modeling stack (activations, accelerate, sympy): about 60 MB of resident memory a server keeps for reading a
few dozen numbers (issue 11, benchmarks/HISTORY.md "memory.py"). The numbers themselves still come from
transformers, once: the first read of a config.json resolves it with AutoConfig (each architecture's
defaults, renamed and derived fields such as rope_parameters or layer_types) and stores `to_dict()` under
the cache; later reads load that JSON into an `HFConfig`. That first read runs AutoConfig in a child process
(pagedserve/model_metadata.py), so not even a server's first start keeps the modeling stack. The cache key
is the file's bytes and the installed transformers version, so an edited config.json or a transformers
upgrade resolves again.

    $PAGEDSERVE_CACHE_DIR/configs/<sha256(config.json, transformers version)[:16]>.json

An HFConfig answers the attribute reads the model code makes (`hf_config.hidden_size`, `getattr(hf_config,
"sliding_window", None)`) exactly as the transformers object would, since it holds that object's fields.
The rare paths that need transformers' own object (scaled rotary frequencies) rebuild it with
`as_transformers_config`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from types import SimpleNamespace

from pagedserve import envs, model_metadata

logger = logging.getLogger(__name__)


class HFConfig(SimpleNamespace):
    """The fields of a transformers config, as attributes."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def read_config(path: str):
    """The config.json of a model directory: an HFConfig, resolved by transformers once and cached."""
    config_file = os.path.join(path, "config.json")
    try:
        with open(config_file, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"cannot read config.json in {path}: {e}") from e
    key = hashlib.sha256(raw + b"|" + metadata.version("transformers").encode()).hexdigest()[:16]
    cached = os.path.join(envs.cache_dir(), "configs", f"{key}.json")
    fields = _read_cached(cached)
    if fields is None:
        text = json.dumps(_resolve_with_transformers(path))
        try:
            _write_atomically(cached, text)
        except OSError as e:  # a read-only cache costs the transformers import on every start, nothing else
            logger.warning("cannot cache the resolved config of %s in %s: %s", path, cached, e)
        fields = json.loads(text)  # the same object whether it came from transformers or the cache
    fields["_name_or_path"] = path  # as AutoConfig sets it; not part of the cached content
    return HFConfig(**fields)


def _read_cached(file: str) -> dict | None:
    # None when there is no cached entry, or one that is not a JSON object (a garbage or half-written file,
    # which is then resolved and written again).
    try:
        with open(file, encoding="utf-8") as f:
            fields = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        logger.warning("ignoring the unreadable cached config %s (%s); resolving it again", file, e)
        return None
    if not isinstance(fields, dict):
        logger.warning("ignoring the cached config %s: not a JSON object; resolving it again", file)
        return None
    return fields


def as_transformers_config(hf_config):
    # transformers' own config object for code that calls into transformers with it.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(hf_config, HFConfig):
        return hf_config
    return CONFIG_MAPPING[hf_config.model_type].from_dict(hf_config.to_dict())


def _resolve_with_transformers(path: str) -> dict:
    # In a child process (pagedserve/model_metadata.py): the config classes it imports would stay in this one.
    try:
        return json.loads(model_metadata.run("config", path).splitlines()[-1])
    except ValueError as e:
        raise ValueError(f"cannot read config.json in {path}: {e}") from e


def _write_atomically(file: str, text: str) -> None:
    # Written to a temporary name and renamed: a concurrent reader sees the whole file or none.
    os.makedirs(os.path.dirname(file), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=os.path.dirname(file))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
