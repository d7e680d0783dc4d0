"""Training: the RL loop of paper §4.1, its update step and a whole run around it.

The loop and its steps
    loop            `RLTrainer.iteration`: rollout, reward, advantages, log π_old, N policy updates
    rows            the typed values between the steps (`SampledGroups`, `TrainingRows`)
    scoring         rewards of the responses, split over the processes
    kl_reward       the frozen reference policy and the KL penalty in the reward
    minibatches     the N mini-batches of a rollout batch (consecutive or length-balanced)
    batch           policy-update batches: sequences, buckets, micro-batches (pure)
    batch_layout    a mini-batch laid out and placed for the update step
    step            the update, log-prob and supervised steps, as `Program`s (`respo_jax.programs`)
    iteration_metrics  the iteration's metrics record and rollout-file arrays
    async_rollouts  rollouts with bounded staleness on their own thread or mesh
    warmup          the supervised warm-up before RL
    held_out        held-out greedy accuracy and sampled pass@1

Set-up
    config          the typed, validated experiment configuration (re-exported from respo_jax.config)
    tasks           the task's tokenizer, prompt format and records
    model_setup     the mesh and the model, the rollout mesh's placement
    startup         the checks made before a model is built
    limits          positions and memory limits
    placement       which rows each process holds
    shapes, compile_ahead, compilation  compiled shapes, programs compiled ahead, compile counts and cache

A whole run
    run             `run(config) -> summary`: checkpoints, resume, logs, trackers, preemption
    checkpoint      verified Orbax checkpoints; warmup_checkpoint, the warm-up's own
    run_dir, run_lock, write_errors  the run directory, its single writer, failed writes in one line
    preemption      stopping at a step boundary on SIGTERM / SIGINT, time-based checkpoints
    trackers, plots TensorBoard / W&B, training curves
    sweep           a matched sweep of objectives × reuse ratios × seeds
"""
