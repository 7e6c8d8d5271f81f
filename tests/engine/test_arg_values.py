"""The engine's size values (``engine/arg_values.py`` ``parse_size``): ``kv_cache_memory``, ``swap_space`` and
``--kv-cache-memory`` read them; binary units whichever way they are written (a CLI trial's ``1TB`` was refused
while ``1GB`` was taken)."""

from __future__ import annotations

import pytest

from engine.arg_values import parse_size


@pytest.mark.parametrize("text, size", [
    (1024, 1024), ("512MiB", 512 * 2**20), ("512MB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5G", 3 * 2**29),
    ("1TB", 2**40), ("1 TiB", 2**40), ("64k", 64 * 2**10), ("100b", 100), ("7", 7)])
def test_sizes_in_every_spelling_of_the_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1GiB", "1PB"])
def test_what_is_not_a_size_is_refused_with_an_example(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_size(text)


def test_a_bad_size_in_the_gateway_config_names_its_key():
    from gateway.config.compile import load_config_text
    from gateway.config.schema import ConfigError

    text = ("models: [{name: m}]\nbackends: {local: {type: local, engine: {kv_cache_memory: lots}}}\n"
            "routes: {r: {targets: [{backend: local}]}}\npolicy: {default_route: r}\n")
    with pytest.raises(ConfigError) as e:
        load_config_text(text)
    assert e.value.errors[0][0] == "backends.local.engine.kv_cache_memory", e.value.errors
    assert load_config_text(text.replace("lots", "1TB")).config.backends["local"].engine.kv_cache_memory == 2**40
