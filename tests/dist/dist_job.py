"""Run under torchrun: rank 0 scores and generates with a multi-rank engine and writes the results as JSON.

job["mode"] == "stream": rank 0 streams a long generation and touches `out` after each token (the failure
test kills a rank meanwhile); every rank writes its pid to `<out>.rank<N>.pid` first. job["mode"] == "score_mid":
the prompts stepped by hand, the first prompt scored after the fifth step (steps in flight) and again at the end.
"""

import json
import os
import sys
from pathlib import Path

from k3runtime.dist.launch import run


def main():
    engine, out, job = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    Path(f"{out}.rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))

    def drive():
        from k3runtime import LLM, SamplingParams

        llm = LLM(engine, **job["options"])
        greedy = SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
        if job.get("mode") == "stream":
            for i, _ in enumerate(llm.stream(job["prompts"][0], greedy)):
                out.write_text(str(i))
            return
        if job.get("mode") == "score_mid":  # score while steps are in flight, then again after them
            eng, ids, tokens = llm.engine, {}, {}
            for i, p in enumerate(job["prompts"]):
                ids[eng.add_request(p, greedy).request_id] = i
            steps = 0
            while eng.has_unfinished():
                for ev in eng.step():
                    tokens.setdefault(ids[ev.request_id], []).append(ev.token_id)
                steps += 1
                if steps == 5:
                    mid = llm.logits(job["prompts"][0]).tolist()
            result = {"logits": mid, "logits_after": llm.logits(job["prompts"][0]).tolist(),
                      "tokens": [tokens[i] for i in range(len(job["prompts"]))], "stats": eng.stats}
            out.write_text(json.dumps(result))
            return
        result = {"logits": llm.logits(job["prompts"][0]).tolist(),
                  "tokens": [o.token_ids for o in llm.generate(job["prompts"], greedy)],
                  "stats": llm.engine.stats, "backend": llm.engine.expert_backend}
        out.write_text(json.dumps(result))

    run(engine, drive)


if __name__ == "__main__":
    main()
