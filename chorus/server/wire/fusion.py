"""OpenRouter's fusion request shape, read as a chorus mixture-of-agents ensemble.

OpenRouter documents ``"plugins": [{"id": "fusion", "analysis_models": [...], "model": "JUDGE"}]`` on a chat
request: a panel answers in parallel and a judge writes the answer. That maps onto ``mixture_of_agents``:
``analysis_models`` are the proposers (``members``) and ``model`` is the aggregator. What does not map is
refused with a 400 that says why (docs/api.md): chorus has no server tools (``tools`` other than ``[]``,
``max_tool_calls``), no presets (``preset``), and other plugins are not served. ``enabled: false`` turns the
plugin off, as OpenRouter documents. Fields of the request's ``ensemble`` object other than the panel and the
judge (``trace``, ``quorum``, ``skip_judge`` ...) apply on top.
"""

from __future__ import annotations

from typing import Any

from chorus.errors import InvalidRequest

FIELDS = {"id", "enabled", "analysis_models", "model", "tools", "max_tool_calls", "preset"}
PANEL_MAX = 8  # as OpenRouter caps the panel


def ensemble_of(plugins: Any, ensemble: dict[str, Any] | None) -> dict[str, Any] | None:
    """The request's ``ensemble`` with the fusion plugin folded in (unchanged without one)."""
    if plugins is None:
        return ensemble
    if not isinstance(plugins, list) or not all(isinstance(p, dict) for p in plugins):
        raise InvalidRequest("'plugins' must be a list of objects, each with an 'id'.", param="plugins")
    fusion: dict[str, Any] | None = None
    for i, plugin in enumerate(plugins):
        if plugin.get("id") != "fusion":
            raise InvalidRequest(f"plugins[{i}]: the plugin {plugin.get('id')!r} is not served here; this server "
                                 "serves 'fusion' (a mixture_of_agents ensemble).", param=f"plugins[{i}].id")
        fusion = plugin if plugin.get("enabled", True) is not False else None
        where = f"plugins[{i}]"
        unknown = sorted(set(plugin) - FIELDS)
        if unknown:
            raise InvalidRequest(f"{where}: unknown fusion field(s) {', '.join(unknown)}; fusion takes "
                                 f"{', '.join(sorted(FIELDS))}.", param=f"{where}.{unknown[0]}")
        if plugin.get("tools") not in (None, []):
            raise InvalidRequest(f"{where}.tools: this server has no server tools (web search, web fetch): the "
                                 "panel answers from what its models know; pass [] or leave it out.",
                                 param=f"{where}.tools")
        if plugin.get("max_tool_calls") is not None:
            raise InvalidRequest(f"{where}.max_tool_calls: this server has no server tools for the panel to call.",
                                 param=f"{where}.max_tool_calls")
        if plugin.get("preset") is not None:
            raise InvalidRequest(f"{where}.preset: this server has no fusion presets; name the panel with "
                                 "'analysis_models' and the judge with 'model', or use a configured "
                                 "mixture_of_agents ensemble as the request's model.", param=f"{where}.preset")
    if fusion is None:
        return ensemble
    out = dict(ensemble or {})
    clash = sorted({"strategy", "members", "aggregator"} & set(out))
    if clash:
        raise InvalidRequest(f"'plugins' (fusion) and 'ensemble.{clash[0]}' both say what the ensemble is; send "
                             "one of them.", param=f"ensemble.{clash[0]}")
    out["strategy"] = "mixture_of_agents"  # without a panel: the members of the ensemble the request names
    panel = fusion.get("analysis_models")
    if panel is not None:
        if (not isinstance(panel, list) or not 1 <= len(panel) <= PANEL_MAX
                or not all(isinstance(m, str) and m for m in panel)):
            raise InvalidRequest(f"'analysis_models' must be 1 to {PANEL_MAX} model names.",
                                 param="plugins.analysis_models")
        out["members"] = list(panel)
    judge = fusion.get("model")
    if judge is not None:
        if not isinstance(judge, str) or not judge:
            raise InvalidRequest("'model' (the fusion judge) must be a model name.", param="plugins.model")
        out["aggregator"] = judge
    return out
