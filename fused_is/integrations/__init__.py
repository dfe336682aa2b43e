"""Drop-ins for the trainers' own loss code: `fused_is.integrations.trl` (TRL's GRPOTrainer).

Each submodule imports its trainer, so import it only where that trainer is installed; `import fused_is`
imports none of them.
"""
