"""The step-boundary runtime of a training job, and its entry point.

    hook            `DynatrainHook`: at each step boundary, poll, prepare, switch, stand by
    switching       rebuild the `Trainer` on layout B around `transition.switch_layout`
    memory_check    A and B together on every device: measure, agree, decide
    growth          admit joiners: grow the world and switch onto it
    death_recovery  re-form the world after a rank died and resume on the survivors
    arguments       the `--dynatrain*` and training flags
    main            the training entry point (`scripts/pretrain_gpt.py`)
    launch          `dynatrain launch`: start ranks so that survivors keep running
"""
