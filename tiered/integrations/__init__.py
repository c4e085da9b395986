"""Drop-ins for the trainers people use (optional extras, imported only where named):

- `tiered.integrations.lightning.TieredCheckpointIO`: a Lightning ``CheckpointIO`` plugin
  (``pip install 'tiered[lightning]'``).
- `tiered.integrations.hf.TieredCallback`: a Hugging Face ``TrainerCallback``, with
  `tiered.integrations.hf.resume_checkpoint` to resume from a tiered step
  (``pip install 'tiered[hf]'``).

Both keep a trainer's checkpoint as one tiered step (its tensors, through the engine) and a small
pointer file where the trainer expects its checkpoint (`tiered.integrations.common`).
"""
