"""The training loop: the Trainer and its phases, the update's log-probs, optimizer, distributed setup
(DDP, FSDP2), held-out evaluation, the SFT cold start. Imports every layer below it (core to run)."""
