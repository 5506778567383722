"""The training objectives' torch side, one folder each (language_model/, preference/), each folder's ``TRAINING``
an ObjectiveTraining (training.py); which one a recipe trains is dstrain.objectives.registry's to say."""
