"""Discrete-event simulation of the scheduling core: predict P99 and pick a config before traffic.

engine.py (event loop, pluggable target) · target.py (the encoder BatchScheduler as a target) ·
traces.py / workloads.py / synthetic.py / texts.py (what arrives) · metrics.py · plots.py ·
tune.py (capacity search) · cli.py (``batchpilot simulate`` / ``tune``). See docs/simulator.md.
"""
