"""Wire formats: JSON in -> GenerationRequest out; response bodies and stream frames out."""
