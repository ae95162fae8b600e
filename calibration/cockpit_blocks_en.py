"""Hand-written English building blocks of the built-in cockpit set: system prompts, slot values, threads.

A thread is a short coherent exchange on one topic, a list of (user, assistant)
pairs with ``{slot}`` placeholders; ``calibration.cockpit_set`` fills the slots
and strings threads of different topics together into dialogues.
"""
from __future__ import annotations

SYSTEM_PROMPTS = [
    "You are Cabin, the voice assistant of this car. Keep answers short and clear: the driver is listening "
    "while driving. Never encourage unsafe actions.",
    "You are the in-car assistant. Answer in one or two sentences, confirm every action you take on the car, "
    "and ask before doing anything that costs money.",
    "You are a helpful in-vehicle assistant with access to navigation, climate, media, phone and vehicle data. "
    "Be brief. If something is unsafe while driving, say so and offer an alternative.",
]

SLOTS = {
    "dest": ["the airport, Terminal 2", "Riverside Mall", "St. Mary's Hospital", "the office on Market Street",
             "Lakeview Park", "Central Station", "Grandma's place on Oak Avenue", "the IKEA in Westfield",
             "the Pine Ridge trailhead", "the stadium", "Jenny's school", "the downtown library"],
    "road": ["the I-280", "Highway 101", "the ring road", "Bay Bridge", "Route 9", "the coastal highway"],
    "road2": ["El Camino Real", "the old county road", "Route 17", "the river parkway", "Main Street"],
    "charger": ["the Shell Recharge on Harbor Road", "the Ionity station at Greenfield services",
                "the Electrify America at Westgate Center", "the supercharger behind Costco"],
    "cafe": ["Blue Bottle", "a Starbucks", "Joe's Diner", "Peet's Coffee"],
    "garage": ["Fifth Street Garage", "City Center Parking", "the Plaza parking deck", "Union Square Garage"],
    "street": ["Fifth Street", "Elm Street", "Harrison Avenue", "Pier Road"],
    "contact": ["Mom", "Alex", "Sarah", "David", "Emma", "Coach Miller", "my wife", "Dr. Patel's office"],
    "artist_song": [("Taylor Swift", "Cruel Summer"), ("Coldplay", "Yellow"), ("Adele", "Rolling in the Deep"),
                    ("Ed Sheeran", "Perfect"), ("Queen", "Don't Stop Me Now"), ("Norah Jones", "Come Away with Me"),
                    ("The Beatles", "Here Comes the Sun"), ("Miles Davis", "So What")],
    "genre": ["jazz", "classical", "lo-fi", "80s pop", "country", "kids' sing-along"],
    "podcast": ["The Daily", "Freakonomics Radio", "99% Invisible", "Hidden Brain", "Planet Money"],
    "station": ["KQED 88.5", "Jazz FM 102.2", "Classic Rock 97.3", "BBC Radio 2"],
    "dealer": ["Bayside Motors", "Northgate Service Center", "City Auto Care", "the dealer on Hillview Road"],
    "gas_station": ["the Chevron on Lincoln Avenue", "the Shell at exit 24", "the Arco on Park Street"],
    "weather": ["sunny", "cloudy", "light rain", "foggy", "clear and windy"],
    "weather_tomorrow": ["mostly sunny", "overcast", "showers in the afternoon", "windy with some sun"],
    "city": ["San Diego", "Monterey", "Sacramento", "Lake Tahoe", "Santa Barbara"],
    "day": ["Tuesday", "Wednesday", "Thursday", "Friday", "Monday"],
    "car_name": ["My Car", "Cabin EV", "Model Y", "ID.4"],
}

THREADS: dict[str, list[list[tuple[str, str]]]] = {
    "navigation": [
        [("Take me to {dest}.",
          "Route to {dest} is set: {dist} km, about {eta} minutes via {road}. Traffic is light. Starting guidance."),
         ("Is there a faster way?",
          "The way via {road2} is a little shorter, but road works there make it about the same. I'll keep the "
          "current route unless you want to switch."),
         ("Keep it. And tell me when we're ten minutes out.", "Sure, I'll remind you ten minutes before arrival.")],
        [("Find a fast charger on the way to {dest}.",
          "There's a {kw} kW charger at {charger}, a {detour}-minute detour, with three of four stalls free. "
          "Add it as a stop?"),
         ("Yes, add it. How much battery will I have when I get there?",
          "You'll reach the charger with about {arrive_battery}%. Charging to 80% takes around {charge_min} minutes."),
         ("Okay. Is there coffee nearby?", "Yes, {cafe} is in the same lot and open until 10 pm.")],
        [("What's the traffic like on {road}?",
          "There's a slowdown near exit {exit} after an accident, about {delay} extra minutes. Want me to route "
          "around it?"),
         ("Yes, avoid it.", "Rerouted via {road2}. New arrival time is {arrival}."),
         ("Avoid toll roads too.", "Done, tolls avoided. That adds about four minutes; arrival is now {arrival_late}.")],
        [("I need to park near {dest}. Any garages?",
          "{garage} is a three-minute walk from {dest}, four dollars an hour, with about 40 free spaces. Street "
          "parking there is almost full."),
         ("Navigate to the garage then.", "Heading to {garage}. The entrance is on {street}, on your right."),
         ("Are there restrooms there?", "Yes, on the ground floor of the garage, next to the pay stations.")],
        [("How far are we from home?", "You're {dist} km from home, about {eta} minutes in current traffic."),
         ("Send my ETA to {contact}.", "Sent to {contact}: \"On my way, I'll be home around {arrival}.\"")],
        [("Add a stop at a pharmacy before {dest}.",
          "I found a pharmacy on {street}, open until 9 pm, two minutes off the route. Adding it as the first stop."),
         ("How does that change the arrival time?",
          "With a ten-minute stop you'll reach {dest} at about {arrival_late} instead of {arrival}.")],
    ],
    "climate": [
        [("I'm cold.", "I've raised the cabin to {temp_up} °C and turned on your seat heater at level 2."),
         ("Turn the seat heater off in five minutes.", "Okay, the seat heater will switch off in five minutes."),
         ("The windshield is fogging up too.",
          "Front defrost is on and the air is set to fresh air. It should clear in a minute or two.")],
        [("Set the temperature to {temp} degrees.", "Cabin set to {temp} °C for both zones."),
         ("Make the passenger side two degrees warmer.",
          "Passenger side is now {temp_plus2} °C; the driver side stays at {temp} °C."),
         ("And lower the fan a bit, it's loud.", "Fan lowered from level {fan} to level {fan_low}.")],
        [("Can you warm up the car before I leave work tomorrow?", "Sure. What time do you usually leave?"),
         ("Around {leave_time}.",
          "Scheduled: the cabin will be at {temp} °C and the battery warmed up by {leave_time} on weekdays. It uses "
          "grid power while the car is plugged in."),
         ("Only tomorrow, not every day.", "Changed to a one-time schedule for tomorrow at {leave_time}.")],
        [("It smells stuffy in here.",
          "I've switched to fresh air and set the fan to level 4. Would you like the air purifier on too?"),
         ("Yes, and open the sunroof a little.",
          "Air purifier on and the sunroof is open to the vent position. Outside air quality is good right now, "
          "AQI {aqi}.")],
        [("It's really hot, cool it down fast.",
          "Max cooling is on: {temp_low} °C, fan at level 6, recirculation on. I'll go back to {temp} °C once the "
          "cabin has cooled."),
         ("Can you cool the seats as well?", "Seat ventilation is on at level 3 for the driver."),
         ("The kids in the back are still hot.",
          "I've turned on the rear vents and set the rear zone to {temp_low} °C as well.")],
    ],
    "media": [
        [("Play something by {artist}.", "Playing \"{song}\" by {artist} from your library."),
         ("Turn it up.", "Volume raised to {volume}."),
         ("Skip this one.", "Skipping. Next up is another track from the same album."),
         ("Who's the drummer on this album?",
          "I don't have album credits offline. I can look it up once we're connected, or you can check the song "
          "details on the screen when the car is parked.")],
        [("Resume my podcast.", "Resuming \"{podcast}\", episode {episode}, at minute {minute}."),
         ("Go back thirty seconds.", "Rewound 30 seconds."),
         ("Play it a bit faster.", "Playback speed set to 1.2x.")],
        [("Put on some {genre} music for the kids.",
          "Playing a {genre} playlist. I can send it to the rear speakers only, if you like."),
         ("Yes, rear only, and keep navigation prompts in front.",
          "Done: music plays in the rear, navigation prompts stay on the front speakers.")],
        [("Switch to the radio, {station}.", "Tuned to {station}."),
         ("What's this song?", "It's \"{song}\" by {artist}."),
         ("Save it to my favorites.", "Added \"{song}\" to your favorites.")],
        [("Lower the music when someone talks to me.",
          "Okay, media volume will drop automatically during calls and navigation prompts. Should I also lower it "
          "when you speak to me?"),
         ("Yes.", "Done. Music ducks while you talk to me and comes back afterwards.")],
    ],
    "phone": [
        [("Call {contact}.", "Calling {contact} on mobile."),
         ("Never mind, hang up. Send a message instead: running fifteen minutes late.",
          "Call ended. Message to {contact}: \"Running fifteen minutes late.\" Send it?"),
         ("Send.", "Sent.")],
        [("Read my new messages.",
          "You have two new messages. {contact} says: \"Can you pick up bread on the way home?\" And the dentist's "
          "office reminds you of your appointment on {day} at 10 am."),
         ("Reply to {contact}: sure, whole wheat?", "Replying to {contact}: \"Sure, whole wheat?\" Send it?"),
         ("Yes. And add bread to my shopping list.", "Message sent, and bread is on your shopping list.")],
        [("Who called me earlier?",
          "You missed a call from {contact} at {missed_time}. There's no voicemail."),
         ("Call them back.", "Calling {contact}."),
         ("It went to voicemail. Remind me to try again when I park.",
          "Okay, I'll remind you to call {contact} when you park.")],
        [("Turn on do not disturb until I get home.",
          "Do not disturb is on until you arrive home. Calls from your favorites will still ring through."),
         ("What if there's an emergency?",
          "If someone calls twice within three minutes, the second call rings through. Emergency calls from the car "
          "are never blocked.")],
        [("Text {contact} that I'm at the entrance.", "Message to {contact}: \"I'm at the entrance.\" Send it?"),
         ("Add that I'm in the gray car.",
          "Updated: \"I'm at the entrance, in the gray car.\" Sending now."),
         ("Did they read it?", "Yes, {contact} read it a moment ago and replied: \"Coming out now!\"")],
    ],
    "vehicle": [
        [("How much range do I have left?",
          "The battery is at {battery}%, about {range_km} km of range with your recent driving."),
         ("Is that enough to get to {dest} and back?",
          "The round trip is about {round_trip} km, so yes, with roughly {spare} km to spare. I'd still plug in "
          "tonight."),
         ("Remind me to plug in when I get home.", "I'll remind you when you park at home.")],
        [("Why is the tire pressure light on?",
          "The rear left tire is at {pressure} bar, below the recommended 2.5 bar. The other three are normal."),
         ("Is it safe to keep driving?",
          "At moderate speed for a short distance, yes, but check it soon: low pressure increases wear and braking "
          "distance. There's an air pump at {gas_station}, {detour} minutes away."),
         ("Navigate there.", "Navigating to {gas_station}.")],
        [("When is my next service due?",
          "Your next service is due in {service_km} km or in {service_weeks} weeks, whichever comes first: the "
          "annual inspection plus a brake fluid change."),
         ("Book it at the usual place.",
          "I've sent a booking request to {dealer}. They'll confirm by text.")],
        [("What was my average consumption this week?",
          "This week you averaged {consumption} kWh per 100 km over {week_km} km, a bit better than last week."),
         ("How can I improve it?",
          "Preheating while plugged in, keeping the tires at the right pressure and using strong regeneration in "
          "town help most. Speed matters most of all: 110 instead of 130 km/h saves roughly a fifth.")],
        [("Did I lock the car last night?",
          "Yes, the car was locked at {lock_time} and the alarm was armed. No doors or windows were open."),
         ("Then why did I get a notification at 3 am?",
          "That was the over-the-air update finishing. Version {sw_version} is now installed; it improves the range "
          "estimate in cold weather.")],
    ],
    "manual": [
        [("How do I open the charge port manually?",
          "If the charge port won't open, pull the release cord in the trunk, behind the left side panel. It's a "
          "small loop marked with a plug symbol."),
         ("And if the charging cable is stuck?",
          "Unlock the car first; the cable releases when the car unlocks. If it's still stuck, use the same release "
          "cord in the trunk.")],
        [("What does the orange light with an exclamation mark in a circle mean?",
          "That's the brake system warning. It can mean low brake fluid or a fault in the brake system. Stop when "
          "it's safe and read the message in the instrument cluster."),
         ("It says brake fluid low.",
          "Then drive gently to a workshop and avoid long trips. Don't top it up with just any fluid: this car "
          "uses DOT 4. Should I find the nearest service center?"),
         ("Yes please.", "The nearest one is {dealer}, {dist} km away and open until 6 pm. Starting navigation.")],
        [("How do I pair a new phone?",
          "On the center screen go to Settings, Bluetooth, Add device. On your phone pick \"{car_name}\" and confirm "
          "the code shown on both screens."),
         ("It's asking for a PIN.",
          "Enter the six-digit code shown on the center screen. If no code appears, delete the old pairing on your "
          "phone and try again.")],
        [("How do I fold the rear seats?",
          "Pull the lever on the top outer side of each rear backrest and push it forward. The seats split 60/40. "
          "Lower the headrests first."),
         ("Will a bike fit?",
          "With both seats folded the load floor is about 1.8 m long. Most adult bikes fit with the front wheel "
          "removed.")],
        [("What's the towing capacity?",
          "1,600 kg for a braked trailer and 750 kg unbraked, with a maximum tongue load of 80 kg."),
         ("Does towing change the range?",
          "A lot: expect 30 to 50 percent less range when towing, depending on the trailer and your speed.")],
        [("How do I reset the trip meter?",
          "Press and hold the left scroll wheel on the steering wheel for two seconds while the trip page is shown."),
         ("And the tire pressure system after changing wheels?",
          "Go to Settings, Vehicle, Tires, and select Recalibrate with the tires cold and set to 2.5 bar. It "
          "finishes after about ten minutes of driving.")],
    ],
    "assist": [
        [("Turn on adaptive cruise at {speed}.",
          "Adaptive cruise control set to {speed} km/h with a following distance of three bars."),
         ("Why did it just slow down?",
          "The car ahead braked, so adaptive cruise slowed down to keep the gap. It goes back to {speed} km/h "
          "once the lane is clear."),
         ("Shorten the following distance.", "Following distance set to two bars.")],
        [("What does lane keeping actually do?",
          "Lane keeping assist gently steers you back if you drift toward a line without signaling. It does not "
          "drive the car: keep your hands on the wheel and your eyes on the road."),
         ("Why does it keep beeping at me?",
          "It beeps when it doesn't feel your hands on the wheel for about 15 seconds. A light grip is enough; it "
          "senses steering torque."),
         ("Can I turn it off for this trip?",
          "Yes. Lane keeping is off until the car restarts. Lane departure warning stays on.")],
        [("Can the car park itself here?",
          "I see a parallel space on the right that is long enough. Stop, keep your foot on the brake and press "
          "Park Assist. Watch the surroundings; you can stop it anytime by braking."),
         ("It stopped halfway.",
          "It stopped because the rear sensor found an obstacle within 30 cm. Check behind you; you can continue "
          "once it's clear or finish parking by hand.")],
        [("Why didn't the emergency braking warn me back there?",
          "Automatic emergency braking only steps in when a collision is likely. The car ahead was slowing "
          "gradually, so no warning was needed. Forward collision warning is set to medium."),
         ("Set it to early.", "Forward collision warning is now set to early. You may get more warnings in dense "
                              "traffic.")],
        [("Does the blind spot warning work when it rains?",
          "Mostly yes, it uses radar. Heavy rain or mud on the rear bumper can limit it, and then the cluster shows "
          "\"Blind spot monitor unavailable\"."),
         ("It just showed that message.",
          "Then check your mirrors and shoulder when changing lanes. Once you've stopped, wiping the rear corners "
          "of the bumper usually brings it back.")],
    ],
    "greeting": [
        [("Good morning!",
          "Good morning! It's {outside_temp} °C and {weather} outside. Your first meeting is at {meeting_time}."),
         ("Will I be on time?",
          "Yes, the roads to work are clear. You should arrive about ten minutes early.")],
    ],
    "smalltalk": [
        [("Tell me a joke.", "Why did the car get a promotion? It always drove results."),
         ("That's terrible. Another one.", "What do you call a car that tells jokes? An auto-comedian. I'll stop now.")],
        [("I'm getting tired.",
          "Thanks for telling me. You've been driving for {drive_hours} hours. There's a rest area in {rest_km} km "
          "with coffee. Shall I navigate there?"),
         ("Yes, let's stop.",
          "Added the rest area as a stop. Until then I'll cool the cabin a little and play something upbeat.")],
        [("What's the weather going to be like in {city} tomorrow?",
          "Tomorrow in {city}: {weather_tomorrow}, with a high of {high} °C."),
         ("Should I take the scenic route there?",
          "The coastal route adds about 25 minutes, and the morning looks good for it. Leave before noon to enjoy "
          "the view.")],
    ],
    "closing": [
        [("What can you actually do?",
          "I can navigate, control the climate, play music and podcasts, make calls and read messages, check the "
          "car's status and explain features from the owner's manual. Just ask."),
         ("Thanks, you've been really helpful today.", "Happy to help. Drive safely!")],
    ],
}
