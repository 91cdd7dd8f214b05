"""Export to a trainer's own container: streamed, verified, resumable (see ``runner``)."""
