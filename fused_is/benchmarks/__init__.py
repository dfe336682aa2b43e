"""The benchmark drivers behind `fused-is bench` (STYLE.md "Benchmarks"). The library never imports this package
(tests/test_packaging.py checks it); only fused_is/cli.py does.

    common.py        the measuring and reporting helpers every driver shares (timing, peak memory, the
                     measurement loop, environment, tables that fit 100 columns, the bar plot, argument types)
    main.py          `fused-is bench`: forward+backward of the policy loss on logits, every provider; its
                     --triton-configs sweep; --linear and --comms hand over to the two modules below
    linear.py        `fused-is bench --linear`: the loss from hidden states and the lm_head weight
    comms.py         `fused-is bench --comms`: collectives and bytes per distributed call on gloo
    requirements.py  what a `fused-is bench` command line needs installed (scripts/dev.sh bench asks it)

Imports go one way only: common <- linear, comms <- main <- requirements, __main__ (no cycle, lazy imports
included). This file imports nothing, so `python -m fused_is.benchmarks.<module>` loads only what it needs.
"""
