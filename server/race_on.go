//go:build race

package server

// raceEnabled reports a build with the race detector: the test run's checks that cost CPU in
// production (releaseTokens' poisoning) run only there.
const raceEnabled = true
