"""The training objectives: the language-model loss (pretraining, SFT) and preference tuning."""
