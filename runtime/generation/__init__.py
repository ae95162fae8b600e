"""The token loop: prefill and decode over the paged cache, sampling, stop rules and streamed text."""
