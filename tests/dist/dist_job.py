"""Run under torchrun: rank 0 scores and generates with a multi-rank engine and writes the results as JSON.

job["mode"] == "stream": rank 0 streams a long generation and touches `out` after each token (the failure
test kills a rank meanwhile); every rank writes its pid to `<out>.rank<N>.pid` first. job["mode"] == "score_mid":
steps by hand with scores, an abort and a shutdown while steps are in flight (score_mid). job["mode"] == "idle":
generations with pauses of job["idle_s"] between them, and one inside a stream (the workers wait meanwhile).
job["mode"] == "score_fails": rank 0's share of a score fails, then a generation is asked for.
job["load_delay_s"] = {rank: seconds}: those ranks read their weights that much later (a slow disk).
job["engine_by_rank"] = {rank: dir}: those ranks open another engine dir (a stale copy on a node).
"""

import json
import os
import sys
import time
from pathlib import Path

from k3runtime.dist.launch import run


def score_mid(llm, job, greedy) -> dict:
    """The prompts stepped by hand: the first one scored after the fifth step (steps in flight), the second
    aborted after the seventh (its step in flight), the first scored again at the end; then two more requests,
    and the engine shut down with their steps in flight. Counts the collects that found another DP rank's step
    in flight."""
    eng, ids, tokens, collected = llm.engine, {}, {}, []
    collect = eng._collect
    eng._collect = lambda: collected.append(any(eng._in_flight[1:])) or collect()
    for i, p in enumerate(job["prompts"]):
        ids[eng.add_request(p, greedy).request_id] = i
    aborted = next(r for r, i in ids.items() if i == 1)
    steps = 0
    while eng.has_unfinished():
        for ev in eng.step():
            tokens.setdefault(ids[ev.request_id], []).append(ev.token_id)
        steps += 1
        if steps == 5:
            mid = llm.logits(job["prompts"][0]).tolist()
        if steps == 7:
            eng.abort(aborted)
    after = llm.logits(job["prompts"][0]).tolist()
    for p in job["prompts"][2:]:
        eng.add_request(p, greedy)
    for _ in range(3):
        eng.step()
    in_flight = any(f is not None for f in eng._in_flight)
    eng.shutdown()
    return {"logits": mid, "logits_after": after, "tokens": [tokens.get(i, []) for i in range(len(job["prompts"]))],
            "stats": eng.stats, "collected_in_flight": sum(collected), "in_flight_at_shutdown": in_flight}


def logprob_asks() -> list:
    """Requests asking for 2 and 3 alternatives of their tokens (and of their prompt's: 2 and 1; under attention-DP
    the first goes to the driver's DP rank, the second to the other), and one that does not ask."""
    from k3runtime import SamplingParams

    return [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2),
            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=1),
            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)]


def penalized(max_tokens: int) -> list:
    """Two greedy requests with penalties: the first's bias wins its first token and its frequency penalty every
    later one, so its previous token must count at once (with async scheduling, from the ids on the device)."""
    from k3runtime import SamplingParams

    return [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logit_bias={123: 1.5},
                           frequency_penalty=2.0),
            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, repetition_penalty=2.0,
                           presence_penalty=0.5)]


def main():
    engine, out, job = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    engine = job.get("engine_by_rank", {}).get(os.environ["RANK"], engine)
    Path(f"{out}.rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    if delay := job.get("load_delay_s", {}).get(os.environ["RANK"]):
        import k3runtime.llm_engine as llm_engine

        load = llm_engine.load_rank
        llm_engine.load_rank = lambda *a, **k: time.sleep(delay) or load(*a, **k)

    def drive():
        from k3runtime import LLM, SamplingParams

        llm = LLM(engine, **job["options"])
        greedy = SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
        if job.get("mode") == "stream":
            for i, _ in enumerate(llm.stream(job["prompts"][0], greedy)):
                out.write_text(str(i))
            return
        if job.get("mode") == "score_mid":
            out.write_text(json.dumps(score_mid(llm, job, greedy)))
            return
        if job.get("mode") == "score_fails":  # rank 0's share of a score fails (an OOM of its logits, a Ctrl-C)
            from k3runtime.rank_runner import RankRunner

            run_rank = RankRunner.run

            def failing(self, step, *args, **kwargs):
                if step.all_logits:
                    raise MemoryError("rank 0 could not hold the score's logits")
                return run_rank(self, step, *args, **kwargs)

            RankRunner.run = failing
            try:
                llm.logits(job["prompts"][0])
            except MemoryError:
                pass
            RankRunner.run = run_rank
            started = time.monotonic()
            try:
                llm.generate(job["prompts"], greedy)
                after = "generated"
            except Exception as e:  # noqa: BLE001 - what the caller gets is the result
                after = str(e)
            out.write_text(json.dumps({"after": after, "seconds": time.monotonic() - started}))
            return
        if job.get("mode") == "idle":
            first = [o.token_ids for o in llm.generate(job["prompts"], greedy)]
            time.sleep(job["idle_s"])
            stream = llm.stream(job["prompts"][0], greedy)
            streamed = [next(stream).token_id for _ in range(2)]
            time.sleep(job["idle_s"])  # a paused consumer: its request's step may be in flight
            streamed += [c.token_id for c in stream]
            time.sleep(job["idle_s"])
            again = [o.token_ids for o in llm.generate(job["prompts"], greedy)]
            out.write_text(json.dumps({"first": first, "streamed": streamed, "again": again}))
            return
        counts = []  # the micro-batches each step was cut into (pipeline stages)
        choose = llm.engine._micro_batches
        llm.engine._micro_batches = lambda items: counts.append(choose(items)) or counts[-1]
        result = {"logits": llm.logits(job["prompts"][0]).tolist(),
                  "tokens": [o.token_ids for o in llm.generate(job["prompts"], greedy)],
                  "stats": dict(llm.engine.stats), "backend": llm.engine.expert_backend,
                  "micro_batches": sorted(set(counts))}
        # logprobs of two requests (under attention-DP one on each DP rank) beside one that does not ask (in a step
        # with an asking one), from whichever rank samples them
        prompts = job["prompts"][:3]
        outs = llm.generate(prompts, logprob_asks()[:len(prompts)])
        result["logprobs"] = [[[x.logprob, x.top] for x in o.logprobs] for o in outs[:2]]
        result["prompt_logprobs"] = [[x and [x.logprob, x.top] for x in o.prompt_logprobs] for o in outs[:2]]
        result["unasked"] = [outs[2].logprobs, outs[2].token_ids] if len(outs) > 2 else None
        result["penalized"] = [o.token_ids for o in llm.generate(prompts[:2], penalized(job["max_tokens"]))]
        # one request id live once over all DP ranks' schedulers (the least loaded would take a second one)
        llm.engine.add_request(prompts[0], greedy, "twice")
        try:
            llm.engine.add_request(prompts[1], greedy, "twice")
        except ValueError as e:
            result["twice"] = str(e)
        llm.engine.abort("twice")
        result["twice_live"] = sum("twice" in s.requests for s in llm.engine.schedulers)
        out.write_text(json.dumps(result))

    run(engine, drive)


if __name__ == "__main__":
    main()
