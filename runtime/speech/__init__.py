"""Speech in: audio decoded and checked (``audio``), transcribed by a real offline ASR front end (``asr``), a live
PCM stream cut into utterances (``listen``)."""
