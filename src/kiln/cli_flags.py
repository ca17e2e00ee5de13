"""One flag spelling across Kiln's commands: trtexec's camelCase (--saveEngine, --maxModelLen) is primary, and
the kebab-case form (--save-engine, --max-model-len) a user of Polygraphy, vLLM or trtllm-build types is kept as
its alias.

Commands declare their flags in either spelling; `camel_case_flags` then gives every kebab-case flag its
camelCase twin, placed first so that usage lines and --help show it. A camelCase name another flag of the same
command already holds is left to that flag, and the kebab-case flag keeps its own spelling (Kiln's commands
declare no such pair: tests/test_cli_flags.py).
"""

from __future__ import annotations

import argparse


def camel_case(flag: str) -> str:
    """'--max-model-len' -> '--maxModelLen'; a flag without inner dashes is returned as it is."""
    head, *rest = flag[2:].split("-")
    return "--" + head + "".join(w[:1].upper() + w[1:] for w in rest)


def camel_case_flags(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """Give every kebab-case flag of `parser` and of its subcommands, at any depth, its camelCase spelling first.
    Returns the (command, flag) pairs left kebab-case only because their camelCase name belongs to another flag."""
    kept = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # an alias names the same parser twice
                kept += camel_case_flags(sub)
            continue
        spelled = []
        for flag in action.option_strings:
            camel = camel_case(flag) if flag.startswith("--") and "-" in flag[2:] else flag
            if camel != flag and camel not in action.option_strings:
                owner = parser._option_string_actions.get(camel)
                if owner is None:
                    parser._option_string_actions[camel] = action
                    spelled.append(camel)
                elif owner is not action:
                    kept.append((parser.prog, flag))
            spelled.append(flag)
        action.option_strings[:] = sorted(dict.fromkeys(spelled), key=lambda f: "-" in f.lstrip("-"))  # kebab last
    return kept
