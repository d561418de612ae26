"""Pure math on tensors: advantages, the loss (objectives and aggregations by name, KL, masks,
importance weights), the chunked token log-probs of an lm_head, the shared-prompt layout; and the base of
every user-facing error. Imports nothing of leangrpo: it takes tensors and returns tensors."""
