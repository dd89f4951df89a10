"""Hostile and corrupt resource files: each is refused fast with one ResourceConfigError
line naming the file, where and the fix; never MemoryError, RecursionError or a hang."""


import pytest
from conftest import python_peak

from resources import yaml_reader
from resources.config import ResourceConfigError
from resources.validate import load_resource_config, parse_resource_config
from resources.yaml_reader import MAX_BYTES, MAX_DEPTH, MAX_VALUES, read_yaml

CPU_ROLES = "actor: {device_type: cpu}\nreward: {device_type: cpu}\nrollout: {device_type: cpu}\n"


def billion_laughs(levels: int, fan_out: int) -> str:
    """`levels` anchors, each a list of `fan_out` aliases to the one before: fan_out**levels values."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * fan_out)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fan_out)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


HOSTILE = {
    # 9**10 = 3.5e9 values from a 500-byte file. l0 holds 10 values, l_i = 1 + 9 * l_(i-1):
    # 91, 820, 7381, then l4 on line 5 is 66430 > MAX_VALUES (column 5: its anchor).
    "billion laughs": (billion_laughs(10, 9),
                       [f"line 5, column 5: anchors and aliases expand to more than {MAX_VALUES} values",
                        "Fix: write the values out"]),
    "binary alias bomb": (billion_laughs(40, 2), ["expand to more than", "Fix: write the values out"]),
    # The scanner, reading ahead, meets the 33rd "[" (column 7 + 33) before the composer
    # builds level 33 (the mapping is level 1); it refuses at once, not 1024 characters on.
    "deep flow nesting": ("actor: " + "[" * 100_000 + "]" * 100_000 + "\n",
                          [f"line 1, column 40: nested deeper than {MAX_DEPTH} levels",
                           "Fix: flatten the file"]),
    "deep block nesting": ("".join("  " * i + f"k{i}:\n" for i in range(300)) + "  " * 300 + "x: 1\n",
                           [f"nested deeper than {MAX_DEPTH} levels"]),
    "deep through aliases": ("b0: &b0 {x: 1}\n" + "".join(f"b{i}: &b{i} {{<<: *b{i - 1}}}\n"
                                                          for i in range(1, 60)),
                             [f"expand to deeper than {MAX_DEPTH} levels"]),
    # The mapping, its key and the list are 3 values, so item k is value 3 + k: item
    # MAX_VALUES - 2 is one too many. Item k sits at column 7 + 2k.
    "half a million values": ("actor: [" + ",".join(["1"] * 500_000) + "]\n",
                              [f"line 1, column {7 + 2 * (MAX_VALUES - 2)}: more than {MAX_VALUES} values",
                               "Fix: move long lists (such as prompts) into a file of their own"]),
    "recursive alias": ("actor: &a [1, *a]\n", ["line 1, column 8: an alias refers to the value "
                                                "that contains it", "Fix: point each alias"]),
    "not utf-8": (b"actor: {device_type: cpu}\nreward: caf\xe9\n",
                  ["line 2: not UTF-8 text (byte 0xe9 at offset 37)", "Fix: save the file as UTF-8"]),
    "binary file": (b"\x7fELF\x02\x01\x01\x00\x00\x00", ["line 1: character #x007f is not allowed",
                                                         "Fix: check the path points at the YAML"]),
    "over 1 MiB": ("# " + "x" * MAX_BYTES + "\n", ["larger than 1 MiB", "Fix: check the path"]),
    "int of 5000 digits": ("timeout_seconds: " + "9" * 5000 + "\n",
                           ["a value YAML cannot convert (Exceeds the limit", "Fix: quote the value"]),
    "impossible date": ("actor: 2024-13-45\n", ["cannot convert (month must be in 1..12)"]),
    "python tag": ("actor: !!python/object/apply:os.system [echo hi]\n",
                   ["line 1, column 8: invalid YAML (could not determine a constructor",
                    "Fix: remove the tag"]),
    "duplicate key": (CPU_ROLES + "reward: {device_type: cpu}\n",
                      ["line 4, column 1: invalid YAML (duplicate key 'reward')", "Fix: write each key once"]),
}


@pytest.mark.parametrize("text, fragments", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_file_is_refused_fast_in_one_line(tmp_path, text, fragments):
    path = tmp_path / "resources.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with python_peak(16 << 20), pytest.raises(ResourceConfigError) as info:  # refused, not expanded or read whole
        load_resource_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and ". Fix: " in message
    assert "\n" not in message and len(message) < 500
    for fragment in fragments:
        assert fragment in message


def test_anchors_used_a_few_times_still_load(tmp_path):
    path = tmp_path / "resources.yaml"
    path.write_text("actor: &cpu {device_type: cpu, workers: 2, strategy: ddp}\n"
                    "reward: {device_type: cpu}\n"
                    "rollout: {<<: *cpu, strategy: hf}\n")
    config = load_resource_config(path)
    assert (config.role("rollout").workers, config.role("rollout").strategy) == (2, "hf")
    assert config.role("actor").workers == 2


def test_nesting_up_to_the_limit_loads(tmp_path):
    path = tmp_path / "nested.yaml"
    path.write_text("[" * MAX_DEPTH + "]" * MAX_DEPTH)  # the outer list is level 1
    data = read_yaml(path, "nested.yaml")
    for _ in range(MAX_DEPTH - 1):
        data = data[0]
    assert data == []
    path.write_text("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    with pytest.raises(ResourceConfigError, match=f"nested deeper than {MAX_DEPTH} levels"):
        read_yaml(path, "nested.yaml")


def test_expanded_values_are_counted_exactly(tmp_path, monkeypatch):
    # mapping 1 + keys a, b 2 + [1, 2] 3 + the alias *a expanded 3 = 9 values.
    path = tmp_path / "aliases.yaml"
    path.write_text("{a: &a [1, 2], b: *a}\n")
    monkeypatch.setattr(yaml_reader, "MAX_VALUES", 9)
    assert read_yaml(path, "aliases.yaml") == {"a": [1, 2], "b": [1, 2]}
    monkeypatch.setattr(yaml_reader, "MAX_VALUES", 8)
    with pytest.raises(ResourceConfigError, match="expand to more than 8 values"):
        read_yaml(path, "aliases.yaml")


def test_a_file_of_exactly_the_size_limit_is_read(tmp_path):
    path = tmp_path / "padded.yaml"
    path.write_bytes(CPU_ROLES.encode() + b"#" * (MAX_BYTES - len(CPU_ROLES)))
    assert load_resource_config(path).role("actor").device_type == "cpu"


def test_long_values_and_keys_are_cut_short_in_the_message(tmp_path):
    path = tmp_path / "resources.yaml"
    path.write_text(CPU_ROLES.replace("{device_type: cpu}", "{device_type: '" + "x" * 500_000 + "'}", 1))
    with pytest.raises(ResourceConfigError) as info:
        load_resource_config(path)
    assert f"actor.device_type: '{'x' * 96}...: not a device type. Fix: use cuda or cpu." in str(info.value)

    data = {**{"actor": {"device_type": "cpu"}}, "k" * 10_000: 1}
    with pytest.raises(ResourceConfigError) as info:
        parse_resource_config(data)
    assert info.value.path == "k" * 97 + "..."
    assert len(str(info.value)) < 500


def test_a_huge_list_is_shown_by_its_first_items():
    ids = list(range(10_000))
    with pytest.raises(ResourceConfigError) as info:
        parse_resource_config({"actor": {"device_type": "cpu", "device_ids": ids},
                               "reward": {"device_type": "cpu"}, "rollout": {"device_type": "cpu"}})
    assert info.value.value == "[0, 1, 2, 3, 4, 5, 6, 7, ...]"
    assert "a cpu role takes no GPU ids" in str(info.value)
