"""Outputs computed from a dataset's samples (a teacher's embeddings, generated captions), kept in a
sidecar beside nothing and attached to the very samples they were computed from: `writer`
(`OutputWriter`, exactly once, resumable), `epochs` (each rank's commits, and an epoch finished
once all are: its indexes, in bounded memory), `attach` (read with the samples, in their read-ahead),
`of` (what a sidecar is of, and what refuses it). The format: `pipeline.format.outputs`."""
