
r3"
	fixed_0.5