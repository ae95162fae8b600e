"""Multi-turn dialogues: the Session protocol, the overflow policies, the reference session and its file."""
