"""The trainer as N ranks (`train.trainer_devices` > 1, or several trainer nodes): one optional layer
over the one-node core (common/runtime/). It imports the core, never the node layer
(common/runtime/nodes/); the core imports nothing from here."""
