"""What both trainers share: the correction mixin and the resume state."""
