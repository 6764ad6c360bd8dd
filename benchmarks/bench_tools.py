"""The tools the benchmarks' agents call. Worker processes load this file with ``--tools``, so
these live in the default registry as a user's tools would.

``odd`` and ``odd_echo`` are the chaos soak's odd payloads (benchmarks/soak.py imports
``ODD_PAYLOADS`` to check that the step log reads back exactly what the tools returned).
"""

from __future__ import annotations

from agentrun.tools import ToolContext, tool

#: What ``odd(kind)`` returns: text PostgreSQL cannot hold as is (NUL, lone surrogates), text
#: that is valid but unusual (and looks like escapes), and a large result. One definition, read by
#: the tool (in the worker) and by the soak's checker (in the soak).
ODD_PAYLOADS: dict[str, str] = {
    "nul": "nul:\x00|two:\x00\x00|a literal backslash-u escape: \\u0000|end\x00",
    # "\ud83d\ude00" is two lone surrogates in a Python str (not the emoji they would pair to).
    "surrogates": "high:\ud800|low:\udfff|reversed:\udc00\ud800|split pair:\ud83d\ude00"
    "|a literal escape: \\ud800|end",
    "unicode": "bom:\ufeff|nonchars:\uffff\ufffe|rtl:\u202eabc\u202c|zwj:\U0001f469\u200d"
    "\U0001f469\u200d\U0001f467|astral:\U0001d518\U0010ffff|combining:e\u0301|line sep:\u2028"
    '|para sep:\u2029|controls:\x01\x1f\x7f\x85|literals: \\u0000 \\\\ \\"|quotes:"\'|end',
    # About 250 KB of UTF-8 (1-, 2-, 3- and 4-byte characters).
    "huge": "ascii 0123456789 \u00e9\u00e8 \u4e2d\u6587 \U0001f600 | " * 7_000,
}


@tool(kind="pure", inline=True)  # returns at once: no thread hop
def echo(ctx: ToolContext, text: str) -> str:
    """Echo the text back."""
    return text


@tool(kind="pure", inline=True)  # returns at once: no thread hop
def odd(ctx: ToolContext, kind: str) -> str:
    """Return the soak's odd payload of that kind."""
    return ODD_PAYLOADS[kind]


@tool(kind="pure", inline=True)  # returns at once: no thread hop
def odd_echo(ctx: ToolContext, text: str) -> str:
    """Echo the text back (the model's odd text, round-tripped through a tool)."""
    return text
