"""Run under torchrun: rank 0 scores and generates with a multi-rank engine and writes the results as JSON."""

import json
import sys

from k3runtime.dist.launch import run


def main():
    engine, out, job = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

    def drive():
        from k3runtime import LLM, SamplingParams

        llm = LLM(engine, **job["options"])
        greedy = SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
        result = {"logits": llm.logits(job["prompts"][0]).tolist(),
                  "tokens": [o.token_ids for o in llm.generate(job["prompts"], greedy)],
                  "stats": llm.engine.stats}
        with open(out, "w") as f:
            json.dump(result, f)

    run(engine, drive)


if __name__ == "__main__":
    main()
