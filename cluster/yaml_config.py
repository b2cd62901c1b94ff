"""Reading a YAML config file (job configs, fleet files): yaml.safe_load, except that a key
given twice in one mapping is an error naming both lines. PyYAML keeps the last one
silently: a job config's `slots: 8` then `slots: 9` ran with 9, a fleet file's second
`nodes:` block dropped the first block's nodes from the plan."""
from __future__ import annotations

from typing import Any

import yaml


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping: the message names it and both lines (not the file)."""


class UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # (`<<: *base` then a key: an override)
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class says so
                break
            if first is not None:
                raise DuplicateKeyError(f"line {line}: key {key!r} is given twice in one mapping "
                                        f"(first on line {first}); YAML would keep only the last")
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """yaml.safe_load that refuses a repeated key (DuplicateKeyError, a yaml.YAMLError)."""
    return yaml.load(text, Loader=UniqueKeyLoader)
