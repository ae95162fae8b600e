"""RESULTS.md from a cabin-bench results object: the whole table, ratios pair by pair, dialogue TTFT, claims."""
from __future__ import annotations

from cabinllm.benchmarks.claims import CLAIM_CONTEXT


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _speed(results: dict, runner: str, context: int, metric: str) -> float | None:
    return next((r[metric] for r in results["speed"]["rows"] if r["runner"] == runner and r["context"] == context),
                None)


def _main_table(results: dict) -> list[str]:
    contexts = results["settings"]["contexts"]
    at = CLAIM_CONTEXT if CLAIM_CONTEXT in contexts else max(contexts)
    budget = results["settings"]["kv_budget_mib"]
    kv = {r["runner"]: r for r in results["kv_memory"]}
    ttft = {}
    if results.get("multiturn"):
        turns = results["multiturn"]["turns"]
        for name in turns[0]["ttft_s"]:
            ttft[name.removesuffix(" (reuse)")] = (turns[1 if len(turns) > 1 else 0]["ttft_s"][name],
                                                    turns[-1]["ttft_s"][name])
    accuracy = results.get("accuracy", {}).get("rows", {})
    head = (["system", "KV storage", "KV bytes/token", "vs our fp16", f"longest context in {budget} MiB",
             f"prefill tok/s @{at}"] + [f"decode tok/s @{c}" for c in contexts]
            + [f"TTFT turn 2 / turn {len(results['multiturn']['turns'])} (ms)" if ttft else "TTFT",
               "ppl vs fp32", "KL", "top-1 agree"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for runner in results["runners"]:
        name = runner["name"]
        if runner["status"] == "unavailable":
            lines.append(f"| {name} | unavailable (see below) |" + " |" * (len(head) - 2))
            continue
        m = kv.get(name, {})
        capacity = ("-" if "max_tokens" not in m else
                    f"{m['max_tokens']:,}" + (f" (model: {m['max_tokens_usable']:,})"
                                               if m["max_tokens_usable"] < m["max_tokens"] else ""))
        acc = accuracy.get(name, {})
        t = ttft.get(name)
        cells = [name, runner["kv"], _num(m.get("bytes_per_token"), "{:,.0f}"),
                 _num(m.get("vs_cabin_fp16"), "{:.2f}x"), capacity, _num(_speed(results, name, at, "prefill_tok_s"))]
        cells += [_num(_speed(results, name, c, "decode_tok_s"), "{:.2f}") for c in contexts]
        top1 = None if acc.get("top1_agree") is None else 100 * acc["top1_agree"]
        cells += ["-" if t is None or None in t else f"{t[0] * 1000:.0f} / {t[1] * 1000:.0f}",
                  "-" if not acc else f"{acc['ppl_delta_pct']:+.2f}% ({acc['eval_mode']})",
                  _num(acc.get("kl"), "{:.4f}"), _num(top1, "{:.1f}%")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ratio_table(results: dict, metric: str) -> list[str]:
    ratios = [r for r in results["speed"]["ratios"] if r["metric"] == metric]
    peers = list(dict.fromkeys(r["peer"] for r in ratios))
    rows = list(dict.fromkeys((r["ours"], r["context"]) for r in ratios))
    lookup = {(r["ours"], r["context"], r["peer"]): r for r in ratios}
    lines = ["| ours @ context | " + " | ".join(peers) + " |", "|---|" + "---|" * len(peers)]
    for ours, context in rows:
        cells = [_num(lookup[(ours, context, p)]["ratio"], "{:.2f}x") for p in peers]
        lines.append(f"| {ours} @ {context} | " + " | ".join(cells) + " |")
    return lines


def _turn_table(multiturn: dict) -> list[str]:
    names = list(multiturn["turns"][0]["ttft_s"])
    lines = ["| turn | context tokens | new tokens (ours) | " + " | ".join(f"{n} TTFT ms" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for t in multiturn["turns"]:
        cells = [_num(t["ttft_s"][n] and t["ttft_s"][n] * 1000, "{:.0f}") for n in names]
        lines.append(f"| {t['turn']} | {t['context_tokens']} | {t['new_tokens']} | " + " | ".join(cells) + " |")
    growth = multiturn["growth_last_vs_first_quarter"]
    lines += ["", "TTFT of the last quarter of turns / the first quarter (turn 1 left out): "
              + ", ".join(f"{n} {_num(g, '{:.2f}x')}" for n, g in growth.items()) + "."]
    return lines


def _limit_table(limit: dict) -> list[str]:
    bandwidth = limit["read_bandwidth_bytes_s"]
    lines = [f"Read bandwidth (a 1 GiB buffer summed, best of 5): {bandwidth['1'] / 1e9:.1f} GB/s on 1 thread, "
             f"{bandwidth['all'] / 1e9:.1f} GB/s on all cores; fractions against the "
             f"{'1-thread' if limit['against'] == '1' else 'all-core'} figure. Bytes per token: the weights as "
             "held plus the context's KV.", "",
             "| ours @ context | MB read per token | decode tok/s | GB/s read | fraction of the bandwidth |",
             "|---|---|---|---|---|"]
    for r in limit["rows"]:
        lines.append(f"| {r['runner']} @ {r['context']} | {r['bytes_per_token'] / 1e6:.1f} | "
                     f"{r['decode_tok_s']:.2f} | {r['read_bytes_s'] / 1e9:.2f} | {r['fraction']:.2f} |")
    return lines


def render_markdown(results: dict, figures: dict[str, str]) -> str:
    """The whole RESULTS.md text; ``figures`` maps a title to a PNG path relative to the file."""
    s, m = results["settings"], results["machine"]
    lines = ["# cabin-bench results", "",
             f"Written by `cabin-bench` from the run below (not edited by hand). Command: `{results['command']}`; "
             f"the engine was built with `{results['engine_build_command'] or '?'}`.", "",
             f"Machine: {m['cpu']}, {m['cores']} cores ({m['arch']}), {m['os']}; load average "
             f"{_num(m['load_average_1m'], '{:.2f}')} at the start, {_num(results['load_average_end'], '{:.2f}')} at "
             f"the end; torch {m['versions']['torch']} with {m['torch_threads']} thread(s), llama.cpp with the same "
             f"count; transformers {m['versions']['transformers']}, llama-cpp-python "
             f"{m['versions']['llama-cpp-python'] or 'not installed'}, hqq {m['versions']['hqq'] or 'not installed'}, "
             f"optimum-quanto {m['versions']['optimum-quanto'] or 'not installed'}; our native decode kernels built "
             f"with {m.get('c_compiler') or 'no C compiler (torch path)'}.", "",
             f"Model: {results['model']}. Settings: {s['label']}; {s['repeats']} repeat(s), "
             f"each running every system back to back per context in a rotating order; {s['decode_steps']} greedy "
             f"decode tokens per run; prompts are ShareGPT text; the dialogue has {s['turns']} turns "
             f"({results['multiturn']['repeats'] if results.get('multiturn') else 0} repeat(s), replies of "
             f"{s['reply_tokens']} tokens). Figures are medians over repeats; ratios are ours / peer computed within "
             "each repeat, then the median.", "", "## Results", ""]
    lines += _main_table(results)
    lines += ["", "## Systems", ""] + [f"- {r['name']}: KV {r['kv']}; weights {r['weights']}"
                                       for r in results["runners"] if r["status"] != "unavailable"]
    lines += ["", "## Claims", "", "| claim | value | needs | verdict |", "|---|---|---|---|"]
    for c in results["claims"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[c["passed"]]
        lines.append(f"| {c['claim']} | {_num(c['value'], '{:.2f}')} | {c['threshold']} | {verdict} |")
    lines += ["", "## Decode tokens/s, ours / peer", ""] + _ratio_table(results, "decode_tok_s")
    lines += ["", "## Prefill tokens/s, ours / peer", ""] + _ratio_table(results, "prefill_tok_s")
    if results.get("memory_limit"):
        lines += ["", "## Decode against the memory limit", ""] + _limit_table(results["memory_limit"])
    if results.get("multiturn"):
        lines += ["", f"## Time to first token over {s['turns']} turns of a ShareGPT dialogue", ""]
        lines += [f"- {n}: {note}" for n, note in results["multiturn"]["notes"].items()] + [""]
        lines += _turn_table(results["multiturn"])
    lines += ["", "## KV memory", "", "| system | bytes/token | fixed bytes | longest context | how |",
              "|---|---|---|---|---|"]
    for r in results["kv_memory"]:
        if "error" in r:
            lines.append(f"| {r['runner']} | failed: {r['error']} | | | |")
        else:
            lines.append(f"| {r['runner']} | {r['bytes_per_token']:,.0f} | {r['fixed_bytes']:,} | "
                         f"{r['max_tokens']:,} | {r['how']} |")
    problems = [r for r in results["runners"] if r["status"] != "ok"]
    if problems:
        lines += ["", "## Peers unavailable or failed", ""]
        lines += [f"- {r['name']}: {r['status']}: {r['reason']}" for r in problems]
    lines += ["", "## Figures", ""] + [f"![{title}]({path})" for title, path in figures.items()]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    return "\n".join(lines) + "\n"
