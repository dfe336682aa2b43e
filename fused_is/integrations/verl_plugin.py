"""verl's `external_lib` hook: `actor_rollout_ref.model.external_lib=fused_is.integrations.verl_plugin`.

verl imports the external libraries of the model config inside each worker while it builds that config, before
the actor worker binds its loss (`partial(ppo_loss, config=actor_config)` in verl.workers.engine_workers).
Importing this module then
- patches verl's FSDP LM-head engine class (`fused_is.integrations.verl.patch_engine`), so that a loss which
  wants the logits receives the packed logits instead of log_probs, and
- rebinds `ppo_loss` in verl.workers.engine_workers to `engine_ppo_loss`, so the actor's loss is fused_is's.
Every other engine call (old/ref log-prob passes, the critic) runs as before. Ulysses sequence parallelism is
mapped (each rank's slice of the logits, fused_is's sequence_group). Options fused_is cannot take (the fused
kernels, tensor-parallel logits, distillation) are refused by name on the first training step;
`config_from_verl` refuses unmapped loss options the same way.
"""

from fused_is.integrations.verl import engine_ppo_loss, patch_engine

patch_engine()

import verl.workers.engine_workers as _workers  # noqa: E402

_workers.ppo_loss = engine_ppo_loss
