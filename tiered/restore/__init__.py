"""The restore pipeline: read plan -> fetch with per-chunk fallback -> verify -> decode -> place.

`pipeline` holds it; the GPU's half (read into GPU memory, decode there) is `tiered.gpu.decode`.
"""
