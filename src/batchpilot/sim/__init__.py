"""Discrete-event simulation of the scheduling core: predict P99 and pick a config before traffic.

engine.py (event loop, pluggable target) · target.py (the encoder BatchScheduler as a target) ·
service.py (the serving path around the batcher, and how batch times scatter) · fleet.py (replicas,
routing, autoscaling; router.py) · llm.py (the LLM engine as a target) · arms.py (a deployment in
arms) · traces.py / synthetic.py / texts.py (what arrives) · metrics.py / draws.py (what a run
reports) · plots.py · tune.py (capacity search) · cli.py (``batchpilot simulate`` / ``tune``).
See docs/simulator.md.
"""
