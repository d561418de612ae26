"""Pure GRPO math on tensors: advantages, the objectives and their aggregation, KL, masks, importance
weights, the shared-prompt layout; and the base of every user-facing error. Imports nothing of leangrpo:
it takes tensors and returns tensors."""
