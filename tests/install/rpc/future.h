// A header of the outside project that happens to share a name with one of
// Tandem's: Tandem's installed headers must never pick it up.
#error "the outside project's rpc/future.h shadowed Tandem's own"
